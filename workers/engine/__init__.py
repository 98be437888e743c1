"""The inference engine: paged KV cache, prefix caching, continuous batching."""
