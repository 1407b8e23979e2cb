"""The decode pool's node: receives shipped KV blocks (``receiver``), then decodes the request with
continuous batching and streams its tokens."""
