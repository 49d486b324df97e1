"""Safety suite (issue 7): fault injection, fencing and linearizability checks."""
