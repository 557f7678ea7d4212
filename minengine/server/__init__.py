"""The OpenAI-compatible server: an HTTP front end and a scheduler process joined by ZMQ."""
