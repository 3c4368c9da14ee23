"""Placeholder"""
