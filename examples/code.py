"""Unit conversions: each function converts a value from one unit to another."""


def meters_to_feet(meters: float) -> float:
    """Convert a length in meters to feet."""
    return meters * 3.28084


def feet_to_meters(feet: float) -> float:
    """Convert a length in feet to meters."""
    return feet / 3.28084


def kilograms_to_pounds(kilograms: float) -> float:
    """Convert a mass in kilograms to pounds."""
    return kilograms * 2.20462


def pounds_to_kilograms(pounds: float) -> float:
    """Convert a mass in pounds to kilograms."""
    return pounds / 2.20462


def liters_to_gallons(liters: float) -> float:
    """Convert a volume in liters to US gallons."""
    return liters * 0.264172
