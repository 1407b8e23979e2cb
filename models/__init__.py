"""Model side of a node: Llama-family decoder on paged KV, weight loading, sampler."""
