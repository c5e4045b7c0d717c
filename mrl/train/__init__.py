"""mrl.train: the RL loop. `loop.train(spec)` runs a job; `step.train_step` is one step of the
data path (docs/design.md); `components.build` assembles models, engines, data and rewards."""
