"""The Lightning layer: the strategy, the module mixin, data, checkpoints and the callbacks."""
