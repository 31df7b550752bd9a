"""The analysis below the tools: one traced forward with parameters on meta and inputs real,
how each ATen op carries sharded dims (its rules), and a plan replayed on fake ranks op by
op. ``tpfn.explain``, ``tpfn.verify`` and ``tpfn.suggest`` read it."""
