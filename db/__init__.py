"""sdcguard: db."""
