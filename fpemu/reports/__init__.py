"""Reports people read: markdown tables (and plots) written atomically into reports/."""

from fpemu.reports.writer import write_all

__all__ = ["write_all"]
