"""The conformance suite: what "a store works" means, run against every store URL."""
