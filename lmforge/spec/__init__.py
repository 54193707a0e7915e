"""What the config is checked against and the planner computes with, before torch: standard library
only (tests/test_architecture.py checks it), below every other package but lmforge.folders.

  optimizers       the optimizer table (one `OptimizerSpec` per name: hyperparameters, muP rule,
                   state size, the builder in lmforge.optim that torch needs)
  optimizer_state  optimizer_state_bytes_per_param: state memory per parameter, from the table
  parallel         the pipeline schedules and closed-form facts of parallel layouts (stages per rank,
                   bubble, in-flight micro-batches, context-parallel traffic), shared by the runtime
                   (lmforge.parallel), the config's rules and the planner
  scaling_law      Law and Fit: a FIT.json's predictions, written by `lmforge scale fit`
                   (lmforge.scale.fit) and read by `lmforge plan --loss`
"""
