"""JAX integrations: the optax DP-SGD transformation, sharding over a device mesh. Imported only when used."""
