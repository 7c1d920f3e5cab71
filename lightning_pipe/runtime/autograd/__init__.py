"""Autograd pieces: split backward (input and weight gradients) and deferred statistics."""
