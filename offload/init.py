"""`offload.init(config)`: a context that builds a model directly into its shards."""
