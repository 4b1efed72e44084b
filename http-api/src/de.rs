//! Reading request bodies exactly as the OpenAPI description says they are: objects only
//! (serde would also read a struct from a JSON array), and whole numbers however JSON writes
//! them (`2` and `2.0` are the same integer to JSON Schema).

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// A `T` that was written as a JSON object.
pub(crate) struct Object<T>(pub T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ObjectVisitor<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
            type Value = T;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_map(ObjectVisitor(PhantomData)).map(Object)
    }
}

/// A list whose every element is a JSON object (`#[serde(deserialize_with = "objects")]`).
pub(crate) fn objects<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    Vec::<Object<T>>::deserialize(d).map(|v| v.into_iter().map(|o| o.0).collect())
}

/// A whole number from 0 to `max`, written as an integer or as a float without a fraction.
struct Whole(u64);

impl Whole {
    fn read<'de, D: Deserializer<'de>>(d: D, max: u64) -> Result<u64, D::Error> {
        let Whole(n) = Whole::deserialize(d)?;
        if n > max {
            return Err(de::Error::custom(format!("{n} is larger than {max}")));
        }
        Ok(n)
    }
}

impl<'de> Deserialize<'de> for Whole {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct WholeVisitor;
        impl Visitor<'_> for WholeVisitor {
            type Value = Whole;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a whole number, 0 or more")
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Whole, E> {
                Ok(Whole(n))
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Whole, E> {
                u64::try_from(n).map(Whole).map_err(|_| E::custom(format!("{n} is negative")))
            }
            fn visit_f64<E: de::Error>(self, f: f64) -> Result<Whole, E> {
                // Floats above 2^53 are not exact: write such numbers as integers.
                if f.fract() == 0.0 && (0.0..18_446_744_073_709_551_616.0).contains(&f) {
                    Ok(Whole(f as u64))
                } else {
                    Err(E::custom(format!("{f} is not a whole number from 0 to 2^64")))
                }
            }
        }
        d.deserialize_any(WholeVisitor)
    }
}

/// `Option<u64>` that accepts `2.0` as `2` (`#[serde(default, deserialize_with = ...)]`).
pub(crate) fn whole_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Option::<Whole>::deserialize(d).map(|w| w.map(|w| w.0))
}

/// `Vec<u16>` that accepts `2.0` as `2`.
pub(crate) fn whole_u16s<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u16>, D::Error> {
    struct Seq;
    impl<'de> Visitor<'de> for Seq {
        type Value = Vec<u16>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a list of whole numbers")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u16>, A::Error> {
            let mut out = Vec::new();
            while let Some(n) = seq.next_element_seed(WholeSeed(u64::from(u16::MAX)))? {
                out.push(n as u16);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(Seq)
}

struct WholeSeed(u64);

impl<'de> de::DeserializeSeed<'de> for WholeSeed {
    type Value = u64;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<u64, D::Error> {
        Whole::read(d, self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Item {
        key: String,
        #[serde(default, deserialize_with = "whole_u64")]
        cas: Option<u64>,
    }

    #[derive(Debug, serde::Deserialize, PartialEq)]
    struct Items {
        #[serde(deserialize_with = "objects")]
        items: Vec<Item>,
        #[serde(default, deserialize_with = "whole_u16s")]
        buckets: Vec<u16>,
    }

    fn read(text: &str) -> Result<Items, String> {
        serde_json::from_str::<Object<Items>>(text).map(|o| o.0).map_err(|e| e.to_string())
    }

    #[test]
    fn objects_only_and_whole_numbers_however_written() {
        let ok = read(r#"{"items":[{"key":"a","cas":2.0},{"key":"b"}],"buckets":[1,2.0]}"#).expect("reads");
        assert_eq!(ok.items, vec![Item { key: "a".into(), cas: Some(2) }, Item { key: "b".into(), cas: None }]);
        assert_eq!(ok.buckets, vec![1, 2]);
        for bad in [
            r#"[[{"key":"a"}]]"#,
            r#"{"items":[["a"]]}"#,
            r#"{"items":[{"key":"a","cas":2.5}]}"#,
            r#"{"items":[{"key":"a","cas":-1}]}"#,
            r#"{"items":[],"buckets":[70000]}"#,
        ] {
            assert!(read(bad).is_err(), "{bad} is refused");
        }
    }
}
