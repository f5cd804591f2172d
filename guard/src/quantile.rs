//! One quantile of a set of samples (the nearest-rank value), for the risk detector's TTFT p95
//! and the logbook's figures.

/// The value at quantile `q` (0..=1) of `samples`; None for none.
pub fn quantile<T: Copy + PartialOrd>(samples: &[T], q: f64) -> Option<T> {
    if samples.is_empty() {
        return None;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let index = ((sorted.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
    sorted.get(index).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let samples: Vec<u32> = (1..=100).collect();
        assert_eq!(quantile(&samples, 0.95), Some(95));
        assert_eq!(quantile(&samples, 0.5), Some(51));
        assert_eq!(quantile::<u32>(&[], 0.5), None);
        assert_eq!(
            quantile(&[2.0, f64::NAN, 1.0], 1.5).map(|x| x > 0.0),
            Some(true)
        );
    }
}
