"""The HTTP floor of the frontend: server, connections, ASGI helpers, errors, the doors. Imports
no other room of the frontend."""
