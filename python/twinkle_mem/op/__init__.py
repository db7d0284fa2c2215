"""The op ``selective_log_softmax`` on the Python side: loading its native kernels (native.py), its contract
(contract.py), fake kernels and autograd (ops.py), the composite kernel for devices without a native one
(composite.py), tensors to its rows (rows.py), statistics merged across vocab blocks and shards
(row_stats.py), tensor parallelism (vocab_parallel.py), the public functions (functional.py), the float64
reference (reference.py), and the Python custom ops' arguments by name (op_args.py). Imports no other layer
of the package (docs/architecture.md)."""
