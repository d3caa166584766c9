"""sdcguard: recovery."""
