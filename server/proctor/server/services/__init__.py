"""The services the HTTP routes call: sampling, grading, the steps' tables, the views of the run."""
