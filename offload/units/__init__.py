"""Units and shards: how the model is cut into units (partition), a unit's flat layout and
its rank's shard (shard), the collectives over shards (collectives), and the values a
meta-built model's parameters get (materialize)."""
