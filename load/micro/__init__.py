"""In-process micro benchmarks: one engine part against mlx-lm's, no server."""
