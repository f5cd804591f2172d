//! A metric family whose label set is a type: each series is named by a struct with named
//! fields (enums where the values are a fixed set), never by a positional slice, so a missing,
//! extra or swapped label does not compile. The only place that hands label values to the
//! `prometheus` crate by position.

use std::marker::PhantomData;

use prometheus::{
    CounterVec, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts,
    core::{Collector, MetricVec, MetricVecBuilder},
};

/// The names of a label set, and its values for one series.
pub trait Labels {
    /// The values of one series, borrowed for one call.
    type Values<'a>;
    const NAMES: &'static [&'static str];
    /// Calls `with` on the values, in the order of `NAMES`.
    fn with<R>(values: &Self::Values<'_>, with: impl FnOnce(&[&str]) -> R) -> R;
}

/// One metric family: the series of one name, told apart by the label set `L`.
pub struct Family<L, V> {
    vec: V,
    labels: PhantomData<fn(L)>,
}

impl<L, V: Clone> Clone for Family<L, V> {
    fn clone(&self) -> Self {
        Self {
            vec: self.vec.clone(),
            labels: PhantomData,
        }
    }
}

impl<L: Labels, P: MetricVecBuilder + 'static> Family<L, MetricVec<P>> {
    /// The series of `values`, made (at zero) where it does not exist yet.
    pub fn of(&self, values: &L::Values<'_>) -> P::M {
        L::with(values, |values| self.vec.with_label_values(values))
    }

    /// The series of `values` in the order of the label set's names: for tests, which name
    /// many families' series in one table.
    #[cfg(test)]
    pub fn at(&self, values: &[&str]) -> P::M {
        assert_eq!(values.len(), L::NAMES.len(), "the labels {:?}", L::NAMES);
        self.vec.with_label_values(values)
    }

    /// Removes the series of `values`, if it exists.
    pub fn remove(&self, values: &L::Values<'_>) {
        // Absent is fine: there is nothing to remove.
        let _ = L::with(values, |values| self.vec.remove_label_values(values));
    }

    /// Removes every series (a reading that replaces the whole set).
    pub fn reset(&self) {
        self.vec.reset();
    }

    pub fn collector(&self) -> Box<dyn Collector> {
        Box::new(self.vec.clone())
    }
}

impl<L: Labels> Family<L, IntCounterVec> {
    pub fn counter(name: &str, help: &str) -> Self {
        Self::new(IntCounterVec::new(Opts::new(name, help), L::NAMES).expect("valid counter"))
    }
}

impl<L: Labels> Family<L, CounterVec> {
    /// A counter of a measured quantity (joules), which integers would round away.
    pub fn float_counter(name: &str, help: &str) -> Self {
        Self::new(CounterVec::new(Opts::new(name, help), L::NAMES).expect("valid counter"))
    }
}

impl<L: Labels> Family<L, IntGaugeVec> {
    pub fn int_gauge(name: &str, help: &str) -> Self {
        Self::new(IntGaugeVec::new(Opts::new(name, help), L::NAMES).expect("valid gauge"))
    }
}

impl<L: Labels> Family<L, GaugeVec> {
    pub fn gauge(name: &str, help: &str) -> Self {
        Self::new(GaugeVec::new(Opts::new(name, help), L::NAMES).expect("valid gauge"))
    }
}

impl<L: Labels> Family<L, HistogramVec> {
    pub fn histogram(name: &str, help: &str, buckets: &[f64]) -> Self {
        let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
        Self::new(HistogramVec::new(opts, L::NAMES).expect("valid histogram"))
    }
}

impl<L, V> Family<L, V> {
    fn new(vec: V) -> Self {
        Self {
            vec,
            labels: PhantomData,
        }
    }
}

/// Declares label sets: a struct of named values (borrowed for one call) and its `Labels`
/// marker, whose names are the label names.
macro_rules! label_sets {
    ($(
        $(#[$meta:meta])*
        $marker:ident => $values:ident { $($field:ident),+ $(,)? }
    )*) => {$(
        $(#[$meta])*
        #[derive(Clone, Copy, Debug)]
        pub struct $values<'a> { $(pub $field: &'a str),+ }

        #[doc = concat!("The label set of `", stringify!($values), "`.")]
        pub enum $marker {}

        impl $crate::metrics::family::Labels for $marker {
            type Values<'v> = $values<'v>;
            const NAMES: &'static [&'static str] = &[$(stringify!($field)),+];
            fn with<R>(values: &Self::Values<'_>, with: impl FnOnce(&[&str]) -> R) -> R {
                with(&[$(values.$field),+])
            }
        }
    )*};
}
pub(crate) use label_sets;
