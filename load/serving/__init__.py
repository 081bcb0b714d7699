"""Serving experiments: a model behind HTTP against raw mlx-lm and mlx_lm.server."""
