"""Kept so that ``probes.report_html`` imports keep working: the report lives in ``probes.compare.html``."""

from .compare.html import HtmlConfig, render_html, write_html

__all__ = ["HtmlConfig", "render_html", "write_html"]
