"""OpenAI's Responses API: its schema (to a chat request), output items and events, the store of
finished responses, and the endpoint on the chat pipeline."""
