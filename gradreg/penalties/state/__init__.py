"""What one penalty call carries besides tensors: the random state every forward of a call
replays (:mod:`~gradreg.penalties.state.randomness`), the modules' buffers kept across shifted
forwards (:mod:`~gradreg.penalties.state.buffers`), StyleGAN2's running mean
(:mod:`~gradreg.penalties.state.running_mean`) and an fp16 loss scale
(:mod:`~gradreg.penalties.state.loss_scale`). Floor 0 of ``gradreg.penalties``: it imports no
other module of the package."""
