"""dashboards."""
