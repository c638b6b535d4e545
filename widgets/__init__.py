"""Views only: widgets and matplotlib figures fed by plain records; never imports torch or kernels."""
