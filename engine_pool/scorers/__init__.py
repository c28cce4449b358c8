"""The chain's filters and scorers (engine_pool/chain.py), one a file: each is a pure function
of the endpoints' views and the request's ``Ask``."""
