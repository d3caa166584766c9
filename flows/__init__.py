"""sdcguard: flows."""
