"""The encode role: vision-encoder workers (``dynamod --role encode``) and the embedding pages
and cache the prefill/agg workers read their output into (issue 26 item 4)."""
