"""What every edge imports from the core: the data plane, the request and answer types, model descriptions
and the errors a client can act on. Nothing here computes."""
