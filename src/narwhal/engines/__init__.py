"""The router's edge toward engines: HTTP clients, leg bodies, health, breakers, scraping."""
