//! A small pickle writer that encodes exactly as CPython's `pickle.dumps(obj, protocol=4)`
//! (the default protocol of Python 3.8 to 3.13, which `torch.cuda.memory._dump_snapshot`
//! uses), for the types a memory snapshot holds: `None`, `bool`, `int`, `float`, `str`,
//! `list`, `tuple` and `dict`.
//!
//! Why not serde-pickle: it writes every `u64` of 2^31 or more as a 9-byte `LONG1`, which
//! PyTorch's memory visualizer (`MemoryViz.js`) decodes as a `BigInt` (it turns only `LONG1`s
//! of up to 8 bytes into plain numbers) and then fails with "Cannot mix BigInt and other
//! types" on any address or block of 2 GiB or more. Python writes the shortest encoding:
//!
//! | value                     | opcode     | argument                                     |
//! |---------------------------|------------|----------------------------------------------|
//! | 0 ..= 255                 | `BININT1`  | 1 byte                                       |
//! | 256 ..= 65535             | `BININT2`  | 2 bytes, little-endian                       |
//! | -2^31 ..= 2^31-1 (others) | `BININT`   | 4 bytes, little-endian two's complement      |
//! | anything else             | `LONG1`    | length byte, then the fewest little-endian two's-complement bytes (`pickle.encode_long`) |
//!
//! so every integer below 2^63 in magnitude takes at most 8 bytes and `MemoryViz.js` reads it
//! as a `Number`. The rest follows CPython's pickler byte for byte: `PROTO 4`, the body in
//! `FRAME`s that are committed once they reach 64 KiB (checked before each object is saved),
//! `MEMOIZE` after every string, list, tuple and dict, `BINGET`/`LONG_BINGET` for a string
//! saved before (PyTorch builds its snapshot dict from shared key objects, so Python memoizes
//! them too), `APPENDS`/`SETITEMS` in batches of 1000 (`APPEND`/`SETITEM` for a batch of
//! one), `TUPLE1..3` for short tuples, `BINFLOAT` big-endian, `NEWTRUE`/`NEWFALSE`.
//! Loading the bytes with `pickle.loads` and dumping them again with protocol 4 gives the
//! same bytes; `alloc/tests/check_snapshot.py` checks that.
//!
//! [`to_value`] turns any `Serialize` type into a [`Value`] with serde's data model mapped as
//! `serde_json` maps it (structs and maps become dicts, integer map keys become strings,
//! unit variants become strings), so the pickle and the JSON of a type always agree.

use serde::ser::{self, Serialize};
use std::collections::HashMap;
use std::fmt;

/// A Python value.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Value {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    List(Vec<Value>),
    Tuple(Vec<Value>),
    /// Entries in insertion order (Python dicts keep it).
    Dict(Vec<(Value, Value)>),
}

// Opcodes (names as in CPython's `pickle.py`).
const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const STOP: u8 = b'.';
const NONE: u8 = b'N';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const LONG1: u8 = 0x8a;
const LONG4: u8 = 0x8b;
const BINFLOAT: u8 = b'G';
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const BINUNICODE8: u8 = 0x8d;
const EMPTY_LIST: u8 = b']';
const EMPTY_TUPLE: u8 = b')';
const EMPTY_DICT: u8 = b'}';
const MARK: u8 = b'(';
const APPEND: u8 = b'a';
const APPENDS: u8 = b'e';
const SETITEM: u8 = b's';
const SETITEMS: u8 = b'u';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const MEMOIZE: u8 = 0x94;
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';

/// The protocol `pickle.dump` uses by default (Python 3.8 to 3.13).
const PROTOCOL: u8 = 4;
/// CPython's `_Framer._FRAME_SIZE_TARGET` and `_FRAME_SIZE_MIN`.
const FRAME_SIZE_TARGET: usize = 64 * 1024;
const FRAME_SIZE_MIN: usize = 4;
/// CPython's `Pickler._BATCHSIZE`.
const BATCH_SIZE: usize = 1000;

/// Encodes `value` as `pickle.dumps(value, protocol=4)` does.
pub(crate) fn dumps(value: &Value) -> Vec<u8> {
    let mut p = Pickler {
        out: vec![PROTO, PROTOCOL],
        frame: Vec::new(),
        strings: HashMap::new(),
        memo_len: 0,
    };
    p.save(value);
    p.frame.push(STOP);
    p.commit_frame();
    p.out
}

/// `pickle.encode_long`: the fewest little-endian two's-complement bytes that hold `x`
/// (none for 0).
pub(crate) fn encode_long(x: i128) -> Vec<u8> {
    if x == 0 {
        return Vec::new();
    }
    let bit_length = 128 - x.unsigned_abs().leading_zeros() as usize;
    let nbytes = (bit_length >> 3) + 1;
    // 17 bytes: `x` sign-extended, enough for any `nbytes` (at most 17).
    let mut bytes = x.to_le_bytes().to_vec();
    bytes.push(if x < 0 { 0xff } else { 0 });
    bytes.truncate(nbytes);
    if x < 0 && nbytes > 1 && bytes[nbytes - 1] == 0xff && bytes[nbytes - 2] & 0x80 != 0 {
        bytes.pop();
    }
    bytes
}

struct Pickler {
    /// Bytes written so far, outside the current frame.
    out: Vec<u8>,
    /// The frame being filled.
    frame: Vec<u8>,
    /// Memo index of every string saved so far.
    strings: HashMap<String, u32>,
    /// Number of memo entries.
    memo_len: u32,
}

impl Pickler {
    fn write(&mut self, bytes: &[u8]) {
        self.frame.extend_from_slice(bytes);
    }

    /// Ends the current frame: `FRAME` and its length, unless it is too short to bother.
    fn commit_frame(&mut self) {
        if self.frame.len() >= FRAME_SIZE_MIN {
            self.out.push(FRAME);
            self.out.extend_from_slice(&(self.frame.len() as u64).to_le_bytes());
        }
        self.out.append(&mut self.frame);
    }

    /// Appends the next memo index and returns it.
    fn memoize(&mut self) -> u32 {
        self.write(&[MEMOIZE]);
        self.memo_len += 1;
        self.memo_len - 1
    }

    fn save(&mut self, value: &Value) {
        if self.frame.len() >= FRAME_SIZE_TARGET {
            self.commit_frame();
        }
        match value {
            Value::None => self.write(&[NONE]),
            Value::Bool(b) => self.write(&[if *b { NEWTRUE } else { NEWFALSE }]),
            Value::Int(i) => self.save_int(*i),
            Value::Float(f) => {
                self.write(&[BINFLOAT]);
                self.write(&f.to_be_bytes());
            }
            Value::Str(s) => self.save_str(s),
            Value::List(items) => {
                self.write(&[EMPTY_LIST]);
                self.memoize();
                for batch in items.chunks(BATCH_SIZE) {
                    if let [only] = batch {
                        self.save(only);
                        self.write(&[APPEND]);
                    } else {
                        self.write(&[MARK]);
                        batch.iter().for_each(|v| self.save(v));
                        self.write(&[APPENDS]);
                    }
                }
            }
            Value::Tuple(items) => match items.len() {
                0 => self.write(&[EMPTY_TUPLE]),
                n @ 1..=3 => {
                    items.iter().for_each(|v| self.save(v));
                    self.write(&[[TUPLE1, TUPLE2, TUPLE3][n - 1]]);
                    self.memoize();
                }
                _ => {
                    self.write(&[MARK]);
                    items.iter().for_each(|v| self.save(v));
                    self.write(&[TUPLE]);
                    self.memoize();
                }
            },
            Value::Dict(entries) => {
                self.write(&[EMPTY_DICT]);
                self.memoize();
                for batch in entries.chunks(BATCH_SIZE) {
                    if let [(k, v)] = batch {
                        self.save(k);
                        self.save(v);
                        self.write(&[SETITEM]);
                    } else {
                        self.write(&[MARK]);
                        for (k, v) in batch {
                            self.save(k);
                            self.save(v);
                        }
                        self.write(&[SETITEMS]);
                    }
                }
            }
        }
    }

    fn save_int(&mut self, i: i128) {
        if (0..=0xff).contains(&i) {
            self.write(&[BININT1, i as u8]);
        } else if (0..=0xffff).contains(&i) {
            self.write(&[BININT2]);
            self.write(&(i as u16).to_le_bytes());
        } else if (i128::from(i32::MIN)..=i128::from(i32::MAX)).contains(&i) {
            self.write(&[BININT]);
            self.write(&(i as i32).to_le_bytes());
        } else {
            let bytes = encode_long(i);
            if bytes.len() < 256 {
                self.write(&[LONG1, bytes.len() as u8]);
            } else {
                self.write(&[LONG4]);
                self.write(&(bytes.len() as i32).to_le_bytes());
            }
            self.write(&bytes);
        }
    }

    fn save_str(&mut self, s: &str) {
        if let Some(&idx) = self.strings.get(s) {
            if idx < 256 {
                self.write(&[BINGET, idx as u8]);
            } else {
                self.write(&[LONG_BINGET]);
                self.write(&idx.to_le_bytes());
            }
            return;
        }
        let n = s.len();
        if n <= 0xff {
            self.write(&[SHORT_BINUNICODE, n as u8]);
            self.write(s.as_bytes());
        } else {
            let header = if n > 0xffff_ffff {
                let mut h = vec![BINUNICODE8];
                h.extend_from_slice(&(n as u64).to_le_bytes());
                h
            } else {
                let mut h = vec![BINUNICODE];
                h.extend_from_slice(&(n as u32).to_le_bytes());
                h
            };
            if n >= FRAME_SIZE_TARGET {
                // `_write_large_bytes`: end the frame, then header and payload unframed.
                self.commit_frame();
                self.out.extend_from_slice(&header);
                self.out.extend_from_slice(s.as_bytes());
            } else {
                self.write(&header);
                self.write(s.as_bytes());
            }
        }
        let idx = self.memoize();
        self.strings.insert(s.to_owned(), idx);
    }
}

// ---- serde: any `Serialize` type to a `Value` -----------------------------------------------

/// Why a type could not become a [`Value`].
#[derive(Debug)]
pub(crate) struct Error(String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

impl ser::Error for Error {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Error(msg.to_string())
    }
}

/// `value` in Python's terms, laid out as `serde_json` lays it out.
pub(crate) fn to_value<T: Serialize + ?Sized>(value: &T) -> Result<Value, Error> {
    value.serialize(ValueSerializer)
}

struct ValueSerializer;

fn variant(name: &str, value: Value) -> Value {
    Value::Dict(vec![(Value::Str(name.to_owned()), value)])
}

impl ser::Serializer for ValueSerializer {
    type Ok = Value;
    type Error = Error;
    type SerializeSeq = SeqBuilder;
    type SerializeTuple = SeqBuilder;
    type SerializeTupleStruct = SeqBuilder;
    type SerializeTupleVariant = SeqBuilder;
    type SerializeMap = DictBuilder;
    type SerializeStruct = DictBuilder;
    type SerializeStructVariant = DictBuilder;

    fn serialize_bool(self, v: bool) -> Result<Value, Error> {
        Ok(Value::Bool(v))
    }
    fn serialize_i8(self, v: i8) -> Result<Value, Error> {
        Ok(Value::Int(v.into()))
    }
    fn serialize_i16(self, v: i16) -> Result<Value, Error> {
        Ok(Value::Int(v.into()))
    }
    fn serialize_i32(self, v: i32) -> Result<Value, Error> {
        Ok(Value::Int(v.into()))
    }
    fn serialize_i64(self, v: i64) -> Result<Value, Error> {
        Ok(Value::Int(v.into()))
    }
    fn serialize_i128(self, v: i128) -> Result<Value, Error> {
        Ok(Value::Int(v))
    }
    fn serialize_u8(self, v: u8) -> Result<Value, Error> {
        Ok(Value::Int(v.into()))
    }
    fn serialize_u16(self, v: u16) -> Result<Value, Error> {
        Ok(Value::Int(v.into()))
    }
    fn serialize_u32(self, v: u32) -> Result<Value, Error> {
        Ok(Value::Int(v.into()))
    }
    fn serialize_u64(self, v: u64) -> Result<Value, Error> {
        Ok(Value::Int(v.into()))
    }
    fn serialize_u128(self, v: u128) -> Result<Value, Error> {
        i128::try_from(v).map(Value::Int).map_err(|_| Error(format!("{v} exceeds i128")))
    }
    fn serialize_f32(self, v: f32) -> Result<Value, Error> {
        Ok(Value::Float(v.into()))
    }
    fn serialize_f64(self, v: f64) -> Result<Value, Error> {
        Ok(Value::Float(v))
    }
    fn serialize_char(self, v: char) -> Result<Value, Error> {
        Ok(Value::Str(v.to_string()))
    }
    fn serialize_str(self, v: &str) -> Result<Value, Error> {
        Ok(Value::Str(v.to_owned()))
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<Value, Error> {
        Ok(Value::List(v.iter().map(|&b| Value::Int(b.into())).collect()))
    }
    fn serialize_none(self) -> Result<Value, Error> {
        Ok(Value::None)
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<Value, Error> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<Value, Error> {
        Ok(Value::None)
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<Value, Error> {
        Ok(Value::None)
    }
    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<Value, Error> {
        Ok(Value::Str(variant.to_owned()))
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<Value, Error> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        name: &'static str,
        value: &T,
    ) -> Result<Value, Error> {
        Ok(variant(name, to_value(value)?))
    }
    fn serialize_seq(self, len: Option<usize>) -> Result<SeqBuilder, Error> {
        Ok(SeqBuilder::new(len, false, None))
    }
    fn serialize_tuple(self, len: usize) -> Result<SeqBuilder, Error> {
        Ok(SeqBuilder::new(Some(len), true, None))
    }
    fn serialize_tuple_struct(self, _name: &'static str, len: usize) -> Result<SeqBuilder, Error> {
        Ok(SeqBuilder::new(Some(len), true, None))
    }
    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        name: &'static str,
        len: usize,
    ) -> Result<SeqBuilder, Error> {
        Ok(SeqBuilder::new(Some(len), true, Some(name)))
    }
    fn serialize_map(self, len: Option<usize>) -> Result<DictBuilder, Error> {
        Ok(DictBuilder::new(len, None))
    }
    fn serialize_struct(self, _name: &'static str, len: usize) -> Result<DictBuilder, Error> {
        Ok(DictBuilder::new(Some(len), None))
    }
    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        name: &'static str,
        len: usize,
    ) -> Result<DictBuilder, Error> {
        Ok(DictBuilder::new(Some(len), Some(name)))
    }
}

struct SeqBuilder {
    items: Vec<Value>,
    tuple: bool,
    variant: Option<&'static str>,
}

impl SeqBuilder {
    fn new(len: Option<usize>, tuple: bool, variant: Option<&'static str>) -> Self {
        SeqBuilder { items: Vec::with_capacity(len.unwrap_or(0)), tuple, variant }
    }

    fn push<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.items.push(to_value(value)?);
        Ok(())
    }

    fn finish(self) -> Value {
        let v = if self.tuple { Value::Tuple(self.items) } else { Value::List(self.items) };
        match self.variant {
            Some(name) => variant(name, v),
            None => v,
        }
    }
}

impl ser::SerializeSeq for SeqBuilder {
    type Ok = Value;
    type Error = Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.push(value)
    }
    fn end(self) -> Result<Value, Error> {
        Ok(self.finish())
    }
}

impl ser::SerializeTuple for SeqBuilder {
    type Ok = Value;
    type Error = Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.push(value)
    }
    fn end(self) -> Result<Value, Error> {
        Ok(self.finish())
    }
}

impl ser::SerializeTupleStruct for SeqBuilder {
    type Ok = Value;
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.push(value)
    }
    fn end(self) -> Result<Value, Error> {
        Ok(self.finish())
    }
}

impl ser::SerializeTupleVariant for SeqBuilder {
    type Ok = Value;
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.push(value)
    }
    fn end(self) -> Result<Value, Error> {
        Ok(self.finish())
    }
}

struct DictBuilder {
    entries: Vec<(Value, Value)>,
    pending_key: Option<Value>,
    variant: Option<&'static str>,
}

impl DictBuilder {
    fn new(len: Option<usize>, variant: Option<&'static str>) -> Self {
        DictBuilder { entries: Vec::with_capacity(len.unwrap_or(0)), pending_key: None, variant }
    }

    fn finish(self) -> Value {
        let v = Value::Dict(self.entries);
        match self.variant {
            Some(name) => variant(name, v),
            None => v,
        }
    }
}

/// A map key as `serde_json` writes it: strings as they are, numbers and booleans as strings.
fn key_value<T: Serialize + ?Sized>(key: &T) -> Result<Value, Error> {
    match to_value(key)? {
        Value::Str(s) => Ok(Value::Str(s)),
        Value::Int(i) => Ok(Value::Str(i.to_string())),
        Value::Bool(b) => Ok(Value::Str(b.to_string())),
        other => Err(Error(format!("map key must be a string or a number, not {other:?}"))),
    }
}

impl ser::SerializeMap for DictBuilder {
    type Ok = Value;
    type Error = Error;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Error> {
        self.pending_key = Some(key_value(key)?);
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        let key = self.pending_key.take().ok_or_else(|| Error("value without a key".into()))?;
        self.entries.push((key, to_value(value)?));
        Ok(())
    }
    fn end(self) -> Result<Value, Error> {
        Ok(self.finish())
    }
}

impl ser::SerializeStruct for DictBuilder {
    type Ok = Value;
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        self.entries.push((Value::Str(key.to_owned()), to_value(value)?));
        Ok(())
    }
    fn end(self) -> Result<Value, Error> {
        Ok(self.finish())
    }
}

impl ser::SerializeStructVariant for DictBuilder {
    type Ok = Value;
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        self.entries.push((Value::Str(key.to_owned()), to_value(value)?));
        Ok(())
    }
    fn end(self) -> Result<Value, Error> {
        Ok(self.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The opcode and argument `save_int` writes for `i`.
    fn int_bytes(i: i128) -> Vec<u8> {
        let mut p =
            Pickler { out: Vec::new(), frame: Vec::new(), strings: HashMap::new(), memo_len: 0 };
        p.save_int(i);
        p.frame
    }

    #[test]
    fn integers_take_pythons_shortest_encoding() {
        // Expected bytes are what `pickle.dumps(x, protocol=4)` writes for `x` (checked with
        // CPython 3.11), without the header, frame and STOP.
        let cases: &[(i128, &[u8])] = &[
            (0, b"K\x00"),
            (255, b"K\xff"),
            (256, b"M\x00\x01"),
            (65535, b"M\xff\xff"),
            (65536, b"J\x00\x00\x01\x00"),
            (-1, b"J\xff\xff\xff\xff"),
            (i32::MAX as i128, b"J\xff\xff\xff\x7f"),
            (i32::MIN as i128, b"J\x00\x00\x00\x80"),
            (1 << 31, b"\x8a\x05\x00\x00\x00\x80\x00"),
            ((1 << 32) - 1, b"\x8a\x05\xff\xff\xff\xff\x00"),
            (-(1 << 31) - 1, b"\x8a\x05\xff\xff\xff\x7f\xff"),
            (2 << 30 << 10, b"\x8a\x06\x00\x00\x00\x00\x00\x02"),
            ((1 << 47) - 4096, b"\x8a\x06\x00\xf0\xff\xff\xff\x7f"),
            (1 << 47, b"\x8a\x07\x00\x00\x00\x00\x00\x80\x00"),
            (i64::MAX as i128, b"\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f"),
            (i64::MIN as i128, b"\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80"),
            (1 << 63, b"\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x80\x00"),
            (-256, b"J\x00\xff\xff\xff"),
        ];
        for &(i, expected) in cases {
            assert_eq!(int_bytes(i), expected, "{i}");
        }
        assert_eq!(encode_long(-128), [0x80]);
        assert_eq!(encode_long(-32768), [0x00, 0x80]);
        assert_eq!(encode_long(i128::MIN).len(), 16);
        assert_eq!(encode_long(i128::MAX).len(), 16);
    }

    #[test]
    fn a_small_dict_matches_python_byte_for_byte() {
        // pickle.dumps({'a': [1, 'a', (0, 0)], 'b': {'x': 1.5, 'y': None, 'z': True}},
        //              protocol=4)
        let v = Value::Dict(vec![
            (
                Value::Str("a".into()),
                Value::List(vec![
                    Value::Int(1),
                    Value::Str("a".into()),
                    Value::Tuple(vec![Value::Int(0), Value::Int(0)]),
                ]),
            ),
            (
                Value::Str("b".into()),
                Value::Dict(vec![
                    (Value::Str("x".into()), Value::Float(1.5)),
                    (Value::Str("y".into()), Value::None),
                    (Value::Str("z".into()), Value::Bool(true)),
                ]),
            ),
        ]);
        let expected: &[u8] = b"\x80\x04\x956\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01h\x01K\x00K\x00\x86\x94e\x8c\x01b\x94}\x94(\x8c\x01x\x94G?\xf8\x00\x00\x00\x00\x00\x00\x8c\x01y\x94N\x8c\x01z\x94\x88uu.";
        assert_eq!(dumps(&v), expected);
    }

    #[test]
    fn single_items_use_append_and_setitem_and_tiny_pickles_have_no_frame() {
        let v = Value::List(vec![Value::Int(7)]);
        // pickle.dumps([7], protocol=4)
        assert_eq!(dumps(&v), b"\x80\x04\x95\x06\x00\x00\x00\x00\x00\x00\x00]\x94K\x07a.");
        // pickle.dumps(None, protocol=4)
        assert_eq!(dumps(&Value::None), b"\x80\x04N.");
        // pickle.dumps({'k': 1}, protocol=4)
        let d = Value::Dict(vec![(Value::Str("k".into()), Value::Int(1))]);
        assert_eq!(
            dumps(&d),
            b"\x80\x04\x95\x0a\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01k\x94K\x01s."
        );
    }

    #[test]
    fn serde_layout_follows_serde_json() {
        #[derive(serde::Serialize)]
        #[serde(rename_all = "snake_case")]
        enum Kind {
            FreeCompleted,
        }
        #[derive(serde::Serialize)]
        struct S {
            kind: Kind,
            pair: (i64, i64),
            map: std::collections::BTreeMap<u64, i64>,
            skipped: Option<u8>,
        }
        let s = S {
            kind: Kind::FreeCompleted,
            pair: (0, 0),
            map: [(2, 0), (1, 4)].into_iter().collect(),
            skipped: None,
        };
        let v = to_value(&s).unwrap();
        let str_ = |s: &str| Value::Str(s.into());
        assert_eq!(
            v,
            Value::Dict(vec![
                (str_("kind"), str_("free_completed")),
                (str_("pair"), Value::Tuple(vec![Value::Int(0), Value::Int(0)])),
                (
                    str_("map"),
                    Value::Dict(vec![(str_("1"), Value::Int(4)), (str_("2"), Value::Int(0))])
                ),
                (str_("skipped"), Value::None),
            ])
        );
    }
}
