"""Judgement: sanity, paired statistics, noise, roofline, pre-flight rules, failure classification."""
