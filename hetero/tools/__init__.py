"""Checks a user or a test runs against an outside reference: parity (every layout = one device, Tessera = the
released model in transformers), verify, and the multi-rank spawner. The top of hetero/: may import all of it."""
