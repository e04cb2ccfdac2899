"""The Ray Serve wiring under the HTTP face: the app's configuration (serve_config.yaml's `args`),
the LoraReplica deployment (one engine each) and its metrics, and the AdapterRegistry deployment
with its durable store. It imports app.engine and app.model, never app.openai."""
