"""One module per layer kind, each declaring its weights once (shape, dtype, logical sharding
axes, checkpoint field: ``params``) beside the functions that compute it."""
