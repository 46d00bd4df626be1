"""Reading what ranks wrote: aggregation into a RunResult, tables, plots and pages."""
