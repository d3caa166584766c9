"""sdcguard: detection."""
