"""Figures render off-screen: the Agg backend, chosen before pyplot is imported."""
import matplotlib

matplotlib.use("Agg")
