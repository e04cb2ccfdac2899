"""The HTTP face: the OpenAI-compatible Ingress deployment and what it needs to speak OpenAI —
request and response models, errors as HTTP statuses, auth, the admin routes, tool calls, and the
client-side stream from the replicas (migration, n choices). It imports app.serving, never the
other way round."""
