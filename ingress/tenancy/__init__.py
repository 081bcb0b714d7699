"""Tenants at the edge: which tenant an API key belongs to (`policy`), its limits and their
headers (`ledger`; `shared`: counted across HTTP replicas), the middleware and client that apply them (`door`), and the usage kept
per tenant and model (`usage`). The replica's share of it is `replicas.engine.fair_share`."""
