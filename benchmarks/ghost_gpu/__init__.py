"""The parts of the GPU DP-step suite (``benchmarks.bench_ghost_gpu``, its entry point).

``configs`` names what is measured (models, batch sizes, step variants), ``variants`` builds
each step variant from one table, ``timing`` compiles and times a config's steps, and
``results`` merges, writes and tabulates what was measured.
"""
