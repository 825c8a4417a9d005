"""Who is calling: API-key authentication, admin session tokens, the login throttle."""
