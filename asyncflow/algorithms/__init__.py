"""Advantage estimators and policy losses (algorithm-side; engines never see these)."""
