"""The prefill pool's node: computes prompts' KV, samples the first token, ships the blocks to a
decode node (``shipper``) and reuses or serves cached prefixes across nodes (``peer_fetch``)."""
