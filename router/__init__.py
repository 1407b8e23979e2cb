"""The public front door: validates and tokenizes requests, picks a prefill and a decode node,
orchestrates prefill then decode, and relays the token stream as text (``router.server.serve``)."""
