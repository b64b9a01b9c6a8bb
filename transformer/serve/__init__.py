"""`transformer serve`: the JSON API, request batching, the limits a stranger meets, the page."""
