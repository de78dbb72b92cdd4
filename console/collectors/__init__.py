"""Collectors: watch discovery, subscribe to the event plane, scrape frontends; feed a StateSink."""
