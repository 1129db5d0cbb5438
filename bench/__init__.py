"""splitserve bench package."""
