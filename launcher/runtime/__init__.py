"""Code that runs inside a rank. Never imports cli, backends or report."""
