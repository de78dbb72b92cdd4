"""Outage tests: real processes frozen, killed or stopped under load (``@pytest.mark.chaos``)."""
