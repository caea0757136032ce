"""The values model.moe.backend chooses among (the grouped matmul's implementations), apart from
the kernels that dispatch on them: jax-free, so a config is checked before jax loads."""

GROUPED_MATMUL_BACKENDS = ('auto', 'xla', 'tokamax', 'pallas')  # model.moe.backend
